"""Learned EAGLE-style heads: the head (head), its hidden-state capture (hidden), its drafter (head_drafter), the
suffix-or-head hybrid (hybrid_drafter) and the distillation maths (head_train). Builds on drafting/."""
