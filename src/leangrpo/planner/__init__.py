"""`leangrpo plan`: device memory per term from config.json alone, no torch (plan.py),
read off the code paths through a per-layer inventory of saved tensors (inventory.py)."""
