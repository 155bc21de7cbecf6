"""vLLM engines: `VLLMEngine` colocated or over servers (engine.py), the in-process LLM
(local.py), policy identity and its admission rules (versions.py: `NO_VERSION`,
`VersionGate`), `leangrpo serve` (server.py, its HTTP side http.py) and its client
(client.py), the worker extension that loads weights (worker.py), weights and adapters on
disk (files.py) and the settings they share (settings.py). vLLM is imported lazily."""
