"""What every layer stands on: paths, logging, running processes, waiting, text
made safe to print, the wire types shared by the launcher and its clients."""
