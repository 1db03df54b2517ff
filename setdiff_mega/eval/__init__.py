"""Evaluation: likelihoods, embedded tasks, scaling-law sweeps and fits, the lm-eval adapter."""
