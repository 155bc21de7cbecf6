"""Builds the rollout and evaluation engines a config asks for.

- hf, sync: one engine generating with the trainer's own model object (no copy at all).
- hf, async: the producer thread generates from its own copy of the weights, refreshed by
  weight sync; evaluation uses the trainer's model in the main thread.
- vllm: one engine (colocated or servers) used for both, under the producer's lock. A
  colocated one that shares the policy's weights (rollout/vllm/sharing.py) starts before
  the policy, which is built from views of its tensors (`start_shared_engine`), and is
  handed to `make_engines` as `started`; with full fine-tuning in sync mode it then
  generates with the trainer's live weights. A LoRA policy's adapter is checked against
  the modules the vLLM engine serves LoRA on before training (`check_adapter`).

Under torchrun (`ctx.distributed`): the hf engine is one own copy per rank (a sharded
model cannot generate without collectives whose count would depend on each rank's
completion lengths), built from the policy's shards after sharding (`own_copy`, from
`distributed.fsdp.shard_for_training`: the only full copy a rank holds), used for generation
and evaluation and refreshed from gathered weights (every version in sync mode); vLLM
servers are driven by rank 0 alone (other ranks hold no engine); colocated vLLM is refused
by preflight.
"""

from __future__ import annotations

from dataclasses import dataclass

from leangrpo.contracts import RolloutEngine


@dataclass
class Engines:
    rollout: RolloutEngine
    eval: RolloutEngine
    rollout_shares_weights: bool  # generates with the trainer's live weights (tag-only sync)
    eval_shares_weights: bool
    sleep_while_training: bool = False  # colocated vLLM in sync mode frees its memory
    snapshot_device: str | None = None  # where async weight snapshots wait (None = in place)
    # the generator may hold another run's weights (a `leangrpo serve`): the trainer pushes
    # its own at start, before anything is generated
    push_at_start: bool = False

    def close(self) -> None:
        for engine in {id(e): e for e in (self.rollout, self.eval)}.values():
            engine.close()


def start_shared_engine(cfg, device):
    """The colocated vLLM engine that will share the policy's weights, started before the
    policy (`SharedStart`: the engine and the views to build the policy on); None when
    the run keeps two copies or generates otherwise."""
    v = cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or v.mode != "colocate" or v.share_weights is False:
        return None
    from leangrpo.rollout.vllm.sharing import start_shared_vllm

    return start_shared_vllm(cfg, device)


def make_engines(cfg, policy, ctx=None, own_copy=None, started=None) -> Engines | None:
    """The engines; None on torchrun ranks > 0 when rank 0 drives vLLM servers. Under
    torchrun with the hf engine, `own_copy` is the rank's unsharded copy of the policy
    (`distributed.fsdp.shard_for_training`), which the engine takes as its own.
    `started`: the engine `start_shared_engine` started (`SharedStart.engine`)."""
    distributed = ctx is not None and ctx.distributed
    if cfg.rollout.engine == "hf":
        if distributed and own_copy is None:
            raise ValueError("torchrun: the hf engine needs the rank's own unsharded copy")
        return _hf_engines(cfg, policy, own_copy if distributed else None)
    if distributed and not ctx.is_main:
        return None
    return _vllm_engines(cfg, policy, started)


def _hf_engines(cfg, policy, own_copy) -> Engines:
    from leangrpo.rollout.hf.engine import HFEngine

    per_forward = cfg.rollout.hf_prompts_per_forward
    rows = None if per_forward is None else per_forward * cfg.rollout.num_generations
    if cfg.multi_turn() is not None:  # environment or agent: the continuous batch's rows
        rows = cfg.rollout.max_batch_size
    common = dict(
        device=policy.device, max_batch_size=rows, kv_cache_tokens=cfg.rollout.kv_cache_tokens
    )
    if own_copy is not None:  # torchrun: every rank generates its share with its own copy
        own = HFEngine(own_copy, policy.tokenizer, share_weights=False, owned=True, **common)
        return Engines(own, own, False, False)
    live = HFEngine(policy.model, policy.tokenizer, share_weights=True, **common)
    if cfg.pipeline.mode == "sync":
        return Engines(live, live, True, True)
    own = HFEngine(policy.model, policy.tokenizer, share_weights=False, **common)
    return Engines(own, live, False, True)


def _vllm_engines(cfg, policy, started=None) -> Engines:
    from leangrpo.rollout.vllm.engine import make_vllm_engine

    engine = started if started is not None else make_vllm_engine(cfg, policy)
    if policy.is_lora:
        try:  # before training: an adapter vLLM would serve in part is refused now
            engine.check_adapter(name for name, _ in policy.named_trainable_tensors())
        except BaseException:
            engine.close()
            raise
    if started is not None and policy.is_lora:
        engine.adapter_config = policy.model.peft_config["default"]
    # full fine-tuning on shared weights: vLLM serves the trainer's tensors as they are
    live = started is not None and bool(started.backend.storages) and not policy.is_lora
    v = cfg.rollout.vllm
    sleep = v.mode == "colocate" and v.enable_sleep_mode and cfg.pipeline.mode == "sync"
    # the engine reads weights from files written on the host: snapshots wait there too
    return Engines(
        engine,
        engine,
        live,
        False,
        sleep_while_training=sleep,
        snapshot_device="cpu",
        push_at_start=v.mode == "server",
    )
