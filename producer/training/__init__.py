"""Training a draft head for a target on its own answers (`train-draft`) and the draft
vocabulary of a public head (`draft-vocab`): pipeline.py runs the stages, data.py picks
and reads the conversations, heads.py starts, snapshots and saves a head, model_card.py
writes its README, draft_vocab.py counts a vocabulary."""
