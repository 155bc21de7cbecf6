"""Agents as they are written: an OpenAI-compatible endpoint that trains them token-exactly.

Modules: endpoint.py (`AgentEndpoint`: the HTTP server on loopback, served from the run's
rollout engine during generation), sessions.py (`Session`: one episode's requests
recorded as trajectory segments, token in and token out), pump.py (`TurnPump`: the one
thread that drives the engine's turn stream), openai_api.py (the OpenAI wire format:
requests checked, messages normalised, responses made), verifiers_v1.py (a verifiers 0.4 v1
environment as an agent command, run with .venv-verifiers' python). See docs/agents.md.
"""
