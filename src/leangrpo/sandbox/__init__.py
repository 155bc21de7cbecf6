"""The box model-driven code runs in: one confined process per reward call and trajectory.

Environments, tools and rewards run model-driven code, never in the trainer. Trainer
side: levels.py chooses the level and says it in one log line, process.py starts and
talks to one worker, cgroups.py makes a root trainer's worker cgroups. Worker side:
launch.py confines the worker (confine.py) and splits it into the supervisor, which
holds the channel and runs no user code, and the zygote (zygote.py), which imports the
user's code and forks a box (box.py, the public API: `Boxes`, `BoxConn`) per reward call,
trajectory or episode, each confined before it runs anything (its own PID, mount, IPC and
network namespaces, fresh scratch, memory and pids cgroups, a Landlock domain, the
libseccomp filter of seccomp.py) and killed with its tree at its end; calls.py and
output.py are the limits inside a box, frames.py the wire, proctree.py process trees,
forward.py the one endpoint a box without network reaches. docs/sandbox.md has the
threat model ("What each level protects against").
"""
