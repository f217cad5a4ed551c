"""``python -m lightning_bfpp.checkpoint FOLDER OUT``: export a bfpp checkpoint folder to one plain file."""

from . import main

main()
