"""Mixture-of-experts models: their routers (routers.py), the hooks that record, replay
and measure routing and gather the router's auxiliary loss statistics (control.py), and
the route records samples carry from the engine to the trainer (routes.py). See
docs/moe.md.
"""
