"""What operators watch: a task's phases with exact times and one OpenTelemetry trace per
task. The launcher's Prometheus metrics are :mod:`agentbox.launcher.metrics`. See
``docs/reference/metrics.md``."""
