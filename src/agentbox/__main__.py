"""``python -m agentbox``: the same CLI as the ``agentbox`` console script."""

from agentbox.cli import entry

if __name__ == "__main__":
    entry()
