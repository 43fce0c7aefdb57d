"""The sidecar: watches a checkpoint root, validates new checkpoints, loads them into SGLang.

Modules: ``settings`` (configuration), ``sglang_client`` (the SGLang HTTP calls it
makes), ``watcher`` (watchdog events -> a wake-up), ``controller`` (the sync loop
and its state), ``acks`` (acknowledgement files), ``metrics`` (Prometheus), and
``app`` (the FastAPI routes).
"""
