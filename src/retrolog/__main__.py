"""``python -m retrolog``: the same as the ``retrolog`` command."""

from retrolog.cli import main

if __name__ == "__main__":
    main()
