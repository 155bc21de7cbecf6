"""Context parallelism: one packed row split over the ranks of a context-parallel group.

shards.py lays a row over the group (padding to equal contiguous shards, each rank's
completion tokens, the whole row's attention kwargs) and holds `WHOLE_ROW`, the split of
one process; ulysses.py is the Ulysses strategy (an all-to-all from sequence shards to
head shards around attention and back, log-probs put back into the row's order);
exchange.py the collectives it runs on a process group. Torch only, knowing no config:
distributed/mesh.py builds the groups and picks the strategy. See
docs/context-parallel.md.
"""
