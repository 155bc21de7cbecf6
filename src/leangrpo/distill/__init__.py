"""On-policy distillation: a frozen teacher's log-probs as a dense, per-token signal.

teacher.py loads the teacher (full precision, or quantized through the QLoRA loading
path) and scores a packed micro-batch with the same pass as the reference (model/scoring.py:
one backbone forward, the chunked lm_head, no logits); advantages.py turns the student's
and the teacher's log-probs of the sampled tokens into the per-token advantage the loss
takes (`distill.objective: sampled`); check.py checks, before anything loads, the teacher's
files and that the two tokenizers map every id to the same token. The `jsd` objective
needs the teacher's hidden states in the training step instead of its log-probs:
`model.scoring.teacher_rows` and `score_distill`, with the tiled kernel in
ops/logprobs/divergence.py. See the `distill` section of docs/config.md for the
objectives.
"""
