"""Pieces of scripts/make_patches.py: `core` (pristine source, git, lifting, anchored edits,
messages) and one module per patch step (`step_fwd_table`: 0001, `step_splitkv`: 0002)."""
