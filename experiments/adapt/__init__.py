"""The AR-to-SetDLM adaptation recipe and its lever study (``tools/reproduce.py --adapt``): the recipe
(``recipe.py``), its levers, held-out problems, cached evaluation, claims, report and plots."""
