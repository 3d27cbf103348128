"""Training an EAGLE draft head for a target by self-distillation.

data: the target's answers -> per-token features and answer masks (safetensors shards);
loss: the EAGLE objective (feature regression + soft cross-entropy through lm_head);
loop: AdamW with warm-up, bf16 autocast, checkpoints that resume, validation.
"""
