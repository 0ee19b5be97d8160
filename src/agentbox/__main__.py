"""``python -m agentbox``: the same CLI as the ``agentbox`` console script (served by the
front end when one runs, :mod:`agentbox.front`)."""

from agentbox.front.client import entry

if __name__ == "__main__":
    entry()
