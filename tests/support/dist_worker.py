"""One rank of the 2-process CPU (gloo) tests in test_distributed.py, and their references.

Run as `python tests/support/dist_worker.py SCENARIO ARG OUT_DIR [TIMEOUT_S]` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (the test launches one process per rank). Scenarios:

- train MODE: shard the demo model (MODE = full: full fine-tuning with checkpointing and
  hidden-state offload, plus a sharded reference; lora: LoRA), score the fixed batches,
  train STEPS AdamW steps on groups dealt to ranks, gather weights for sync, save a DCP
  checkpoint and the final HF directory. Rank 0 writes what it saw to OUT_DIR/result.pt.
- resume MODE: fresh processes load that checkpoint; rank 0 writes the gathered state.
- fail HOW: rank 1 raises (HOW = raise), is SIGKILLed (kill) or sleeps in phase
  "generate" (hang) inside a sharded forward during phase "train"; rank 0 must exit with
  one line naming rank 1 and the phase.
- stop -: per-rank async producers stopped while one rank's thread waits in a batch
  exchange the other's never joins (distributed.rollout.stop_rank_producer).
- setup_memory -: the tensor bytes alive on each rank after each stage of the trainer's
  set-up (full fine-tuning with a reference and LoRA, both with per-rank hf engines).
- unshared -: a sharded checkpoint whose rank 1 writes its files where rank 0 cannot
  see them: no COMPLETE marker, one CheckpointError on every rank.
- reshard -: which parameters of the sharded policy and reference are held whole
  between passes (after the no-grad passes, after each optimizer step).
- stop_mid_batch -: both threads entered the last batch, and one rank's share of it fails
  before the exchange (on the reward pool closed at shutdown, or earlier).

The single-process reference (`reference_run`) uses the same batches, unsharded.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))  # run as a script: this checkout's leangrpo ...
sys.path.insert(0, str(REPO / "tests"))  # ... and the support package

from leangrpo.config.training import (  # noqa: E402
    DistributedConfig,
    LogprobsConfig,
    LossConfig,
)

DEMO_MODEL = REPO / "examples" / "demo" / "model"
STEPS = 3
GROUPS, GROUP_SIZE = 6, 2
TOKEN_BUDGET = 40  # per micro-batch: in step 0 one rank gets 3, the other 2 (+ padding)
LR = 1e-2
LOGPROBS = LogprobsConfig(chunked=True, row_tile=8, vocab_tile=16)
MAX_NEW_TOKENS = 8  # dr_grpo's normaliser (the modes here use grpo and dapo)
DEVICE = os.environ.get("LEANGRPO_TEST_DEVICE", "cpu")  # "cuda": the GPU (nccl) variant


def loss_cfg(mode: str) -> LossConfig:
    """grpo for full fine-tuning, dapo for LoRA: sequence and global-token normalisers."""
    return LossConfig(type="grpo" if mode == "full" else "dapo", mu=1)


def dist_cfg(
    timeout_s: float = 60.0,
    sharding: str = "full_shard",
    param_dtype: str = "off",
    cpu_offload: bool = False,
) -> DistributedConfig:
    return DistributedConfig(
        sharding=sharding,
        param_dtype=param_dtype,
        reduce_dtype="float32",
        cpu_offload=cpu_offload,
        backend="auto",  # gloo on CPU (the CPU tests), nccl on GPUs
        timeout_s=timeout_s,
    )


def batches() -> list[list[list]]:
    """STEPS generation batches of GROUPS groups of GROUP_SIZE samples (demo vocab: 32)."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    g = torch.Generator().manual_seed(1234)
    out = []
    for step in range(STEPS):
        groups = []
        for k in range(GROUPS):
            gid = step * GROUPS + k
            prompt = torch.randint(
                2, 32, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g
            )
            members = []
            for j in range(GROUP_SIZE):
                n = int(torch.randint(2, 9, (1,), generator=g))
                comp = torch.randint(2, 32, (n,), generator=g).tolist()
                behaviour = (-3.0 + 0.1 * torch.randn(n, generator=g)).tolist()
                members.append(
                    RolloutSample(
                        gid,
                        Prompt(gid, "", prompt.tolist()),
                        Completion(comp, "", behaviour, "stop", 0),
                        advantage=(1.0 if j % 2 == 0 else -1.0) * (1 + k / 10),
                    )
                )
            groups.append(members)
        out.append(groups)
    return out


def build_model(mode: str, *, checkpointing: bool, device="cpu"):
    """The demo model (fp32) with packed attention; LoRA wrapped with a fixed seed;
    mode "untied": full fine-tuning with an lm_head of its own (the demo model ties it)."""
    from transformers import AutoModelForCausalLM

    from leangrpo.ops.attention.adapter import enable_packed_attention
    from leangrpo.ops.offload import enable_gradient_checkpointing

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).to(device)
    enable_packed_attention(model, "sdpa_segments")
    if mode == "untied":
        model.config.tie_word_embeddings = False
        head = model.model.embed_tokens.weight.detach().flip(0) * 1.5  # a deterministic other
        model.lm_head.weight = torch.nn.Parameter(head.contiguous())
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        for name, p in model.named_parameters():  # move off the base so adapters matter
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    offloader = None
    if checkpointing:
        offloader = enable_gradient_checkpointing(
            model, offload="hidden_states", keep_on_device=1, min_tensor_bytes=0
        )
    return model.train(), offloader


def micro_batches(samples: list, uids: list[int], device="cpu", budget: int = TOKEN_BUDGET) -> list:
    """Packed micro-batches; each sequence's `sample_index` is its batch-wide uid."""
    from leangrpo.train.packing import pack_samples, plan_micro_batches

    plan = plan_micro_batches([s.num_tokens for s in samples], budget, "tokens")
    return [
        pack_samples(
            [samples[i] for i in idx], sample_indices=[uids[i] for i in idx], device=device
        )
        for idx in plan
    ]


def flatten(groups: list[list], chosen: list[int]) -> tuple[list, list[int]]:
    """Samples of the chosen groups and their uids (group index * GROUP_SIZE + member)."""
    samples, uids = [], []
    for g in chosen:
        for j, sample in enumerate(groups[g]):
            samples.append(sample)
            uids.append(g * GROUP_SIZE + j)
    return samples, uids


def loss_backward(score_fn, mb, cfg, norm) -> float:
    from leangrpo.train.inputs import loss_inputs
    from leangrpo.train.loss import compute_loss

    logprobs, entropy = score_fn(mb, with_entropy=True)
    inputs, _ = loss_inputs(mb, logprobs, entropy, cfg)
    loss = compute_loss(inputs, norm, cfg).loss
    loss.backward()
    return float(loss.detach())


def per_sample_logprobs(score_fn, mbs) -> dict[int, torch.Tensor]:
    """{uid: (completion tokens,) log-probs} under no_grad."""
    out = {}
    with torch.no_grad():
        for mb in mbs:
            lp, _ = score_fn(mb)
            for s, piece in enumerate(lp.split(mb.completion_lens.tolist())):
                out[int(mb.sample_index[s])] = piece.detach().cpu().clone()
    return out


# ------------------------------------------------------------------------ the reference


def reference_run(mode: str) -> dict:
    """One process, unsharded, whole batches: what the 2-rank run must reproduce."""
    import copy

    from leangrpo.contracts import SamplingParams
    from leangrpo.model.policy import Policy
    from leangrpo.model.scoring import score
    from leangrpo.train.inputs import normalisers

    cfg, sampling = loss_cfg(mode), SamplingParams()
    model, _ = build_model(mode, checkpointing=False)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if mode == "full" else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)

    def score_fn(mb, with_entropy=False):
        return score(model, mb, sampling, LOGPROBS, with_entropy=with_entropy)

    result: dict = {"grad_norms": []}
    for step, groups in enumerate(batches()):
        mbs = micro_batches(*flatten(groups, list(range(len(groups)))))
        if step == 0:
            result["logprobs"] = per_sample_logprobs(score_fn, mbs)
            if reference is not None:
                result["ref_logprobs"] = per_sample_logprobs(
                    lambda mb, with_entropy=False: score(reference, mb, sampling, LOGPROBS), mbs
                )
        norm = normalisers(mbs, cfg, MAX_NEW_TOKENS)
        for mb in mbs:
            loss_backward(score_fn, mb, cfg, norm)
        if step == 0:
            result["grads"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
        result["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    policy = Policy(model, None, None, torch.device("cpu"), is_lora=mode == "lora")
    result["sync"] = [(n, t.clone()) for n, t in policy.named_trainable_tensors()]
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def reference_step0_grads(mode: str) -> dict[str, torch.Tensor]:
    """Step-0 gradients of the whole batch in one process (fp32)."""
    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import score
    from leangrpo.train.inputs import normalisers

    cfg = loss_cfg("full")
    model, _ = build_model(mode, checkpointing=False)
    mbs = micro_batches(*flatten(batches()[0], list(range(GROUPS))))
    norm = normalisers(mbs, cfg, MAX_NEW_TOKENS)
    for mb in mbs:
        loss_backward(
            lambda b, with_entropy=False: score(
                model, b, SamplingParams(), LOGPROBS, with_entropy=with_entropy
            ),
            mb,
            cfg,
            norm,
        )
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_mixed_grads(world_size: int = 2) -> dict[str, torch.Tensor]:
    """Step-0 gradients as FSDP's bf16 mixed precision forms them, in one process: each
    rank's micro-batches (as dealt) through a bf16 copy of the weights, every micro-batch's
    bf16 gradient upcast to fp32 and averaged over ranks."""
    from leangrpo.contracts import SamplingParams
    from leangrpo.distributed.dealing import deal_groups
    from leangrpo.model.scoring import score
    from leangrpo.train.inputs import normalisers

    cfg = loss_cfg("full")
    model, _ = build_model("full", checkpointing=False)
    for p in model.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
        p.data = p.data.to(torch.bfloat16)
    groups = batches()[0]
    deal = deal_groups([[s.num_tokens for s in g] for g in groups], world_size)
    ranks = [micro_batches(*flatten(groups, deal.groups[r])) for r in range(world_size)]
    totals = [sum(normalisers(mbs, cfg, MAX_NEW_TOKENS).sequences for mbs in ranks), 0.0]
    totals[1] = float(sum(normalisers(mbs, cfg, MAX_NEW_TOKENS).tokens for mbs in ranks))
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    for mbs in ranks:
        norm = normalisers(mbs, cfg, MAX_NEW_TOKENS, world_size, lambda local: totals)
        for mb in mbs:
            model.zero_grad(set_to_none=True)
            loss_backward(
                lambda b, with_entropy=False: score(
                    model, b, SamplingParams(), LOGPROBS, with_entropy=with_entropy
                ),
                mb,
                cfg,
                norm,
            )
            for n, p in model.named_parameters():
                acc[n] += p.grad.float() / world_size
    return acc


# ----------------------------------------------------------------------------- the ranks


def sharded_setup(mode: str, ctx, *, checkpointing: bool):
    """The model sharded across the ranks, its scorer (the FSDP root) and AdamW."""
    from leangrpo.distributed.fsdp import shard_model

    model, offloader = build_model(mode, checkpointing=checkpointing, device=ctx.device)
    scorer = shard_model(model, dist_cfg(), ctx)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, scorer, offloader, params, torch.optim.AdamW(params, lr=LR)


def train_ranks(mode: str, out: Path) -> None:
    from leangrpo.checkpoint.sharded import save_final_sharded, save_sharded_checkpoint
    from leangrpo.contracts import SamplingParams
    from leangrpo.distributed.context import init_distributed, reduce_dict_over_ranks
    from leangrpo.distributed.dealing import deal_groups, equal_micro_batch_plan, padding_batch
    from leangrpo.distributed.fsdp import clip_grad_norm, gather_for_sync, shard_model
    from leangrpo.model.scoring import score

    ctx = init_distributed(dist_cfg(cpu_offload=DEVICE == "cuda"), DEVICE)
    cfg, sampling = loss_cfg(mode), SamplingParams()
    with ctx.phase("setup"):
        model, scorer, offloader, params, opt = sharded_setup(
            mode, ctx, checkpointing=mode == "full"
        )
        ref_scorer = None
        if mode == "full":  # a sharded reference (beta > 0 with full fine-tuning)
            plain, _ = build_model("full", checkpointing=False, device=ctx.device)
            ref_scorer = shard_model(plain.eval().requires_grad_(False), dist_cfg(), ctx)

    def score_fn(mb, with_entropy=False):
        return scorer(mb, sampling, LOGPROBS, with_entropy=with_entropy)

    result: dict = {"grad_norms": [], "padded": 0, "imbalance": [], "offloaded": 0}
    try:  # the sharded model itself must not be scored: its root's weights are DTensors
        score(model, micro_batches(*flatten(batches()[0], [0]), ctx.device)[0], sampling, LOGPROBS)
    except RuntimeError as exc:
        result["refused"] = str(exc)
    for step, groups in enumerate(batches()):
        deal = deal_groups([[s.num_tokens for s in g] for g in groups], ctx.world_size)
        result["imbalance"].append(deal.imbalance)
        samples, uids = flatten(groups, deal.groups[ctx.rank])
        mbs = micro_batches(samples, uids, ctx.device)
        plan = equal_micro_batch_plan(ctx, [[i] for i in range(len(mbs))])
        padded = [mbs[idx[0]] if idx else padding_batch(0, ctx.device) for idx in plan]
        result["padded"] += ctx.max_int(len(padded) - len(mbs))
        if step == 0:
            with ctx.phase("score"):  # padding batches too: the same forwards on every rank
                mine = per_sample_logprobs(score_fn, padded)
                ref = {}
                if ref_scorer is not None:
                    ref = per_sample_logprobs(
                        lambda mb, with_entropy=False: ref_scorer(mb, sampling, LOGPROBS), padded
                    )
            gathered = ctx.gather_to_main((mine, ref))
            if ctx.is_main:
                result["logprobs"] = {k: v for m, _ in gathered for k, v in m.items() if k >= 0}
                result["ref_logprobs"] = {k: v for _, r in gathered for k, v in r.items() if k >= 0}
        with ctx.phase("train"):
            result["offloaded"] += accumulate(scorer, offloader, mbs, padded, cfg, ctx)
            if step == 0:
                grads = {
                    n: p.grad.full_tensor().cpu()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
                if ctx.is_main:
                    result["grads"] = grads
            norm_value = clip_grad_norm(params, 1.0)
            result["grad_norms"].append(norm_value)
            if ctx.all_true(math.isfinite(norm_value)):
                opt.step()
            opt.zero_grad(set_to_none=True)
    with ctx.phase("sync"):
        lora = mode == "lora"
        result["sync"] = gather_for_sync(model, ctx, adapters_only=lora, device="cpu")
        result["sync_bf16"] = gather_for_sync(
            model, ctx, adapters_only=lora, dtype=torch.bfloat16, device="cpu"
        )
    with ctx.phase("checkpoint"):
        result["checkpoint"] = str(
            save_sharded_checkpoint(out / "run", STEPS, model, opt, None, {"note": mode}, 2, ctx)
        )
        result["optimizer"] = full_optimizer_state(model, opt, ctx)
        save_final_sharded(out / "run", model, None, ctx)
    if mode == "full":
        with ctx.phase("train"):
            result["strategy_grads"] = other_strategies(ctx)
    result["reduced"] = reduce_dict_over_ranks(ctx, {"rank": float(ctx.rank), "one": 1.0})
    result["everyone"] = ctx.all_gather_object(ctx.rank)
    if ctx.is_main:
        torch.save(result, out / "result.pt")
    ctx.shutdown()


def accumulate(scorer, offloader, mbs, padded, cfg, ctx) -> int:
    """Forward + backward of this rank's micro-batches (padded to the common count) with
    all-reduced normalisers; returns the tensors the offloader moved."""
    import contextlib

    from leangrpo.contracts import SamplingParams
    from leangrpo.distributed.dealing import is_padding, padding_pass
    from leangrpo.train.inputs import normalisers

    sampling, offloaded = SamplingParams(), 0
    norm = normalisers(mbs, cfg, MAX_NEW_TOKENS, ctx.world_size, ctx.all_reduce)
    for mb in padded:
        scope = offloader.step() if offloader is not None else contextlib.nullcontext()
        with scope:
            if is_padding(mb):
                padding_pass(scorer, mb, sampling, LOGPROBS, backward=True, with_entropy=True)
            else:
                loss_backward(
                    lambda b, with_entropy=False: scorer(b, sampling, LOGPROBS, with_entropy),
                    mb,
                    cfg,
                    norm,
                )
        if offloader is not None:
            offloaded += offloader.stats.offloaded
    return offloaded


def other_strategies(ctx) -> dict:
    """Step-0 gradients under shard_grad_op, no_shard, bf16 mixed precision, untied head."""
    from leangrpo.distributed.dealing import deal_groups, equal_micro_batch_plan, padding_batch
    from leangrpo.distributed.fsdp import shard_model

    groups = batches()[0]
    deal = deal_groups([[s.num_tokens for s in g] for g in groups], ctx.world_size)
    mbs = micro_batches(*flatten(groups, deal.groups[ctx.rank]), ctx.device)
    plan = equal_micro_batch_plan(ctx, [[i] for i in range(len(mbs))])
    padded = [mbs[idx[0]] if idx else padding_batch(0, ctx.device) for idx in plan]
    out = {}
    variants = [
        ("shard_grad_op", "off", "full"),
        ("no_shard", "off", "full"),
        ("full_shard", "bfloat16", "full"),
        ("full_shard", "off", "untied"),  # embeddings and lm_head as units of their own
    ]
    if ctx.device.type == "cuda":
        variants.append(("full_shard", "off", "offload"))  # FSDP2 CPU offload
    for sharding, param_dtype, mode in variants:
        offload = mode == "offload"
        model, _ = build_model("full" if offload else mode, checkpointing=False, device=ctx.device)
        cfg = dist_cfg(sharding=sharding, param_dtype=param_dtype, cpu_offload=offload)
        scorer = shard_model(model, cfg, ctx)
        accumulate(scorer, None, mbs, padded, loss_cfg("full"), ctx)
        grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
        out[f"{sharding}/{param_dtype}/{mode}"] = grads
    return out


def full_optimizer_state(model, opt, ctx) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, opt, options=options)
    return state if ctx.is_main else {}


def resume_ranks(mode: str, out: Path) -> None:
    from leangrpo.checkpoint.sharded import load_sharded_checkpoint
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.fsdp import gather_for_sync

    ctx = init_distributed(dist_cfg(), DEVICE)
    with ctx.phase("checkpoint"):
        model, _, _, _, opt = sharded_setup(mode, ctx, checkpointing=False)
        state = load_sharded_checkpoint(
            out / "run" / "checkpoints" / f"step-{STEPS}", model, opt, None, ctx
        )
        result = {
            "state": state,
            "sync": gather_for_sync(model, ctx, adapters_only=False, device="cpu"),
            "optimizer": full_optimizer_state(model, opt, ctx),
        }
    if ctx.is_main:
        torch.save(result, out / "resume.pt")
    ctx.shutdown()


def fail_ranks(how: str, out: Path, timeout_s: float) -> None:
    """Rank 1 fails inside a sharded forward of step 1; rank 0 must stop with one line."""
    from leangrpo.contracts import SamplingParams
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.fsdp import decoder_layers
    from leangrpo.distributed.watch import DistributedError

    ctx = init_distributed(dist_cfg(timeout_s), DEVICE)
    with ctx.phase("setup"):
        model, scorer, _, _, _ = sharded_setup("full", ctx, checkpointing=False)
    calls = {"n": 0}

    def inject(module, args):
        calls["n"] += 1
        if ctx.rank == 1 and calls["n"] == 4:  # fourth step, inside the second layer
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "hang":  # alive, but never joins the next collective
                with ctx.phase("generate"):
                    time.sleep(10 * timeout_s)
            raise ValueError("injected failure")

    decoder_layers(model)[1].register_forward_pre_hook(inject)
    samples, uids = flatten(batches()[0], list(range(GROUPS)))
    try:
        for _ in range(10):
            with ctx.phase("train"):
                for mb in micro_batches(samples, uids, ctx.device)[:1]:
                    lp, _ = scorer(mb, SamplingParams(), LOGPROBS)
                    lp.sum().backward()
                ctx.barrier()
    except DistributedError as exc:  # as the CLI does: no teardown with gloo ops in flight
        print(f"leangrpo: error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    (out / f"finished-{ctx.rank}").write_text("no failure was seen")


class _InstantEngine:
    """Completions at once; only the versions it is pushed matter."""

    def __init__(self):
        self.version = 0

    def generate(self, prompts, params, n, version, prompt_offset=0):
        from leangrpo.contracts import Completion

        return [[Completion([3, 4], "x", [-1.0, -1.0], "stop", version)] * n for _ in prompts]

    def update_weights(self, named_tensors, version):
        self.version = version


class _OneRewards:
    def score(self, samples):
        for s in samples:
            s.rewards, s.reward = {"one": 1.0}, 1.0
        return {}


def stop_ranks(out: Path) -> None:
    """Per-rank async producers at shutdown: rank 0's thread has started batch 1 (it waits
    in its exchange), rank 1's never will (no admissible weights). stop_rank_producer must
    let both stop at once; rank 0 writes what it saw to OUT_DIR/stop.pt."""
    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.data.sampler import PromptSampler
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.rollout import RankShare, stop_rank_producer
    from leangrpo.pipeline.batch import BatchFinisher, RolloutSettings, RolloutWorker
    from leangrpo.pipeline.producers import AsyncProducer

    ctx = init_distributed(dist_cfg(timeout_s=60.0), "cpu")
    share = RankShare(ctx, ctx.new_group())
    prompts = [Prompt(i, str(i), [5, 6]) for i in range(8)]
    settings = RolloutSettings(2, 2, SamplingParams(max_new_tokens=2), "group", 0)
    worker = RolloutWorker(
        _InstantEngine(), _OneRewards(), PromptSampler(prompts, 2), settings, share=share
    )
    producer = AsyncProducer(worker, BatchFinisher(settings, 0), 1, 0, stall_timeout_s=60)
    producer.start()
    whole = producer.next_batch(0)  # batch 0, exchanged by both threads
    if ctx.rank == 0:  # batch 1 needs version 1 (staleness 0): only rank 0's engine gets it
        producer.push_weights(1, lambda: [])
    deadline = time.monotonic() + 20
    while producer.entered < 1 and ctx.rank == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0's thread now waits in batch 1's exchange
    start = time.monotonic()
    stop_rank_producer(producer, share, ctx)
    producer.close()
    took = time.monotonic() - start
    seen = ctx.gather_to_main(
        {
            "entered": producer.entered,
            "alive": producer._thread.is_alive(),
            "took": took,
            "error": repr(producer._error),
            "groups": len(whole.groups()),
        }  # fmt: skip
    )
    if ctx.is_main:
        torch.save(seen, out / "stop.pt")
    ctx.shutdown()


class _SlowOnRank1(_InstantEngine):
    """Rank 1's share of batch 1 takes `delay_s` longer to generate."""

    def __init__(self, rank: int, delay_s: float):
        super().__init__()
        self.rank, self.delay_s = rank, delay_s

    def generate(self, prompts, params, n, version, prompt_offset=0):
        if self.rank == 1 and version >= 1:
            time.sleep(self.delay_s)
        return super().generate(prompts, params, n, version, prompt_offset)


class _ClosableRewards(_OneRewards):
    """Raises as RewardPool does once closed; on rank 1, `fail_at` raises at batch 1."""

    def __init__(self, rank: int, fail_at: bool):
        self.rank, self.fail_at, self.closed, self.calls = rank, fail_at, False, 0

    def score(self, samples):
        from leangrpo.rewards import PoolClosedError

        self.calls += 1
        if self.closed:
            raise PoolClosedError("this RewardPool is closed")
        if self.fail_at and self.rank == 1 and self.calls == 2:
            raise RuntimeError("injected reward failure")
        return super().score(samples)

    def close(self):
        self.closed = True


def stop_mid_batch_ranks(out: Path) -> None:
    """Both threads entered batch 1 when the run ends, and rank 1's share of it fails
    before its exchange, where rank 0's thread waits: (a) "closed": rank 1 still generates
    at shutdown and then scores on the closed reward pool (PoolClosedError), (b) "failed":
    rank 1's reward raised before shutdown. Each rank closes as Trainer.close does
    (stop_rank_producer, rewards.close, producer.close); rank 0 writes OUT_DIR/stop_mid.pt."""
    from leangrpo.contracts import Prompt, SamplingParams
    from leangrpo.data.sampler import PromptSampler
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.rollout import RankShare, stop_rank_producer
    from leangrpo.pipeline.batch import BatchFinisher, RolloutSettings, RolloutWorker
    from leangrpo.pipeline.producers import AsyncProducer

    ctx = init_distributed(dist_cfg(timeout_s=60.0), "cpu")
    seen = {}
    for case in ("closed", "failed"):
        share = RankShare(ctx, ctx.new_group())
        prompts = [Prompt(i, str(i), [5, 6]) for i in range(8)]
        settings = RolloutSettings(2, 2, SamplingParams(max_new_tokens=2), "group", 0)
        engine = _SlowOnRank1(ctx.rank, 5.0 if case == "closed" else 0.0)
        rewards = _ClosableRewards(ctx.rank, fail_at=case == "failed")
        worker = RolloutWorker(engine, rewards, PromptSampler(prompts, 2), settings, share=share)
        producer = AsyncProducer(worker, BatchFinisher(settings, 0), 1, 0, stall_timeout_s=60)
        producer.start()
        producer.next_batch(0)
        producer.push_weights(1, lambda: [])  # batch 1 is admitted on both ranks
        deadline = time.monotonic() + 20
        while producer.entered < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0's thread waits in batch 1's exchange; rank 1's generates
        if case == "failed":  # ... or has failed already
            while producer._error is None and ctx.rank == 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        start = time.monotonic()
        stop_rank_producer(producer, share, ctx)
        rewards.close()
        producer.close()
        seen[case] = {
            "entered": producer.entered,
            "alive": producer._thread.is_alive(),
            "took": time.monotonic() - start,
            "error": repr(producer._error),
        }
    gathered = ctx.gather_to_main(seen)
    if ctx.is_main:
        torch.save(gathered, out / "stop_mid.pt")
    ctx.shutdown()


def gathered_held_at_once(built) -> int:
    """Run one weight sync of `built` (a Trainer) into its per-rank hf engine, and return
    the most bytes of gathered tensors alive at once while the engine takes them in."""
    import weakref

    engine = built.engines.rollout
    update = engine.update_weights
    seen: list[tuple] = []  # (weak reference, storage pointer, bytes) of every tensor given
    peak = 0

    def watched(named):
        nonlocal peak
        for name, tensor in named:
            storage = tensor.untyped_storage()
            seen.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes()))
            alive = {ptr: size for ref, ptr, size in seen if ref() is not None}
            peak = max(peak, sum(alive.values()))
            yield name, tensor

    engine.update_weights = lambda named, version: update(watched(named), version)
    with built.ctx.phase("sync"):
        built.sync_weights()
    engine.update_weights = update
    assert seen, "the sync sent no tensor"
    return peak


def setup_memory_ranks(out: Path) -> None:
    """The trainer's set-up on the demo (full fine-tuning with a reference and the hf
    engine in sync mode; LoRA with the hf engine in async mode), measuring the bytes of
    tensor storages alive on this rank (`fsdp.tensor_bytes_alive`: whole tensors and FSDP
    shards) before it and after each stage: the policy loaded, sharded, the engines built,
    the trainer built; and (sync mode) the storages a weight sync into the per-rank engine
    allocates, at their peak. Every rank writes OUT_DIR/setup-<rank>.pt."""
    import gc
    import pickle

    from leangrpo.config import config_from_dict
    from leangrpo.distributed import fsdp
    from leangrpo.distributed.context import init_distributed
    from leangrpo.train import trainer
    from support.configs import demo_config

    ctx = init_distributed(dist_cfg(), "cpu")
    seen: dict[str, dict[str, dict[str, int]]] = {}

    def measure(stage: str) -> None:
        gc.collect()
        seen[mode][stage] = fsdp.tensor_bytes_alive()

    def after(module, name: str, stage: str) -> None:
        original = getattr(module, name)

        def measured(*args, **kwargs):
            result = original(*args, **kwargs)
            measure(stage)
            return result

        setattr(module, name, measured)

    after(trainer, "load_policy", "loaded")
    after(fsdp, "shard_policy", "sharded")
    after(trainer, "make_engines", "engines")
    for mode in ("full_sync", "lora_async"):
        seen[mode] = {}
        cfg = config_from_dict(demo_config(out / mode, mode, ctx.world_size))
        measure("before")
        built = trainer.Trainer(cfg, ctx=ctx)
        measure("built")
        if mode == "full_sync":  # a weight sync into the engine (sync mode, every version)
            seen[mode]["sync"] = {"held_at_once": gathered_held_at_once(built)}
        built.close()
        del built
    (out / f"setup-{ctx.rank}.pt").write_bytes(pickle.dumps(seen))
    ctx.shutdown()


def unshared_ranks(out: Path) -> None:
    """A sharded checkpoint whose rank 1 writes its part onto a disk of its own (an
    output_dir that is not one filesystem for every rank): every rank must stop with the
    same CheckpointError, and no COMPLETE marker may exist. Rank 0 writes
    OUT_DIR/unshared.pt."""
    from leangrpo.checkpoint import sharded as dist_checkpoint
    from leangrpo.checkpoint.local import CheckpointError
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.watch import DistributedError

    ctx = init_distributed(dist_cfg(timeout_s=10.0), "cpu")
    model, _, _, _, opt = sharded_setup("full", ctx, checkpointing=False)
    if ctx.rank == 1:  # rank 1's files land where rank 0 cannot see them
        write = dist_checkpoint._write_rank_files
        own_disk = out / "rank1-disk"

        def elsewhere(tmp, model, optimizer, ctx):
            (own_disk / tmp.name).mkdir(parents=True)
            return write(own_disk / tmp.name, model, optimizer, ctx)

        dist_checkpoint._write_rank_files = elsewhere
    error = None
    try:
        with ctx.phase("checkpoint"):
            dist_checkpoint.save_sharded_checkpoint(out / "run", 1, model, opt, None, {}, 2, ctx)
    except (CheckpointError, DistributedError) as exc:  # rank 1: its own, or rank 0's line
        error = f"{type(exc).__name__}: {exc}"
    markers = sorted(str(p.relative_to(out)) for p in out.rglob("COMPLETE"))
    (out / f"unshared-{ctx.rank}.pt").write_bytes(
        pickle.dumps({"error": error, "markers": markers})
    )
    if error is not None:  # fatal inside ctx.phase: the backstop ends the process (exit 1)
        time.sleep(60)
    ctx.shutdown()


def damaged_ranks(out: Path) -> None:
    """Two sharded checkpoints (steps 1 and 2); rank 0 then reads step-2's COMPLETE record,
    verifies it, truncates rank 1's shard of step-2 and asks the run directory for the
    newest intact checkpoint. Rank 0 writes OUT_DIR/damaged.pt."""
    from leangrpo.checkpoint.manifest import checkpoint_problem, read_complete
    from leangrpo.checkpoint.rundir import newest_intact_checkpoint
    from leangrpo.checkpoint.sharded import save_sharded_checkpoint
    from leangrpo.distributed.context import init_distributed

    ctx = init_distributed(dist_cfg(), "cpu")
    model, _, _, _, opt = sharded_setup("full", ctx, checkpointing=False)
    with ctx.phase("checkpoint"):
        for step in (1, 2):
            path = save_sharded_checkpoint(out / "run", step, model, opt, None, {}, 2, ctx)
    if ctx.is_main:
        seen = {"record": read_complete(path)["files"], "intact": checkpoint_problem(path)}
        shard = path / "dcp" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-8])
        seen["damaged"] = checkpoint_problem(path)
        seen["resume"] = str(newest_intact_checkpoint(path.parent))
        (out / "damaged.pt").write_bytes(pickle.dumps(seen))
    ctx.shutdown()


def unsharded_parameters(module) -> list[str]:
    """Names of parameters held whole (gathered) right now: none between passes."""
    from torch.distributed.tensor import DTensor

    return [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]


def reshard_ranks(out: Path) -> None:
    """The trainer's pieces (build_policy, shard_policy, plan_steps, attach_old_and_ref,
    train_step) on the demo, full fine-tuning with beta > 0, per sharding strategy: which
    parameters of the policy and of its reference are held whole after the no-grad passes
    and after each optimizer step. Rank 0 writes OUT_DIR/reshard.pt."""
    from transformers import AutoModelForCausalLM

    from leangrpo.config import config_from_dict
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.fsdp import shard_policy
    from leangrpo.distributed.strategy import TorchrunRanks
    from leangrpo.model.policy import build_policy
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.step import train_step
    from support.configs import demo_config

    ctx = init_distributed(dist_cfg(), "cpu")
    samples = [s for g in batches()[0] for s in g]
    for s in samples:
        s.reward = 0.0
    seen: dict = {}
    for sharding in ("full_shard", "shard_grad_op", "no_shard"):
        raw = demo_config(out / "unused", "full_sync", 2, distributed={"sharding": sharding})
        cfg = config_from_dict(raw)
        model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
        policy = build_policy(model, cfg, None, torch.device("cpu"))
        shard_policy(policy, cfg.distributed, ctx)
        opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
        sampling, ranks = cfg.rollout.sampling_params(), TorchrunRanks(ctx)
        stages = seen[sharding] = {}

        def record(stage: str, policy=policy, stages=stages) -> None:
            stages[stage] = {
                "policy": unsharded_parameters(policy.root),
                "reference": unsharded_parameters(policy.reference),
            }

        steps = plan_steps(samples, cfg, policy, ctx.rank, ctx.world_size)
        attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling, ranks)
        record("after the no-grad passes")
        for _ in range(cfg.loss.mu):  # mu = 2: the old pass ran, and two updates follow
            for step in steps:
                train_step(policy, step.micro_batches, opt, cfg, sampling, ranks)
                record(f"after update {len(stages)}")
    gathered = ctx.gather_to_main(seen)
    if ctx.is_main:
        torch.save(gathered, out / "reshard.pt")
    ctx.shutdown()


def main() -> None:
    torch.set_num_threads(1)
    scenario, arg, out, *rest = sys.argv[1:]
    out = Path(out)
    if scenario == "train":
        train_ranks(arg, out)
    elif scenario == "resume":
        resume_ranks(arg, out)
    elif scenario == "fail":
        fail_ranks(arg, out, float(rest[0]))
    elif scenario == "stop":
        stop_ranks(out)
    elif scenario == "stop_mid_batch":
        stop_mid_batch_ranks(out)
    elif scenario == "reshard":
        reshard_ranks(out)
    elif scenario == "setup_memory":
        setup_memory_ranks(out)
    elif scenario == "unshared":
        unshared_ranks(out)
    elif scenario == "damaged":
        damaged_ranks(out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
