"""The paper's claims at CPU scale (``tools/reproduce.py``): train every method, the decoding frontier, infilling,
likelihoods, the quests' diagnostics, the claims and the report."""
