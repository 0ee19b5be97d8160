"""What the two OCI container backends (podman and docker) share.

* :mod:`._sandbox`: the live container sandbox both backends' sandboxes extend;
* :mod:`._args`: the hardening flags and image facts;
* :mod:`._cli`: running the engine's CLI;
* :mod:`._posture`: the posture read off a running container;
* :mod:`._userns_limits`: per-sandbox caps on the kernel counters charged to root.

Only the backends in :mod:`agentbox.backends` use these.
"""
