"""Worker processes for user code: started fresh, confined, limited per call, killed whole.

Environments, tools and rewards run model-driven code, never in the trainer: each runs in a
worker process this package starts (trainer side: levels.py chooses the level and says it
in one log line, process.py starts and talks to one worker, cgroups.py bounds a root
trainer's workers' processes) and confines before any user code runs (worker side:
launch.py, confine.py), calls under limits (calls.py, output.py); frames.py is the wire,
proctree.py finds and kills process trees. The environments and rewards packages bring
the code a worker serves. docs/ARCHITECTURE.md ("Sandbox") has the threat model.
"""
