"""The conversion study (issue 55, ``tools/reproduce.py --convert``): SmolLM2-135M-Instruct converted into AR,
BD3LM and SetDLM children against its own AR fine-tune, on tasks held out by computation: plan, data, train,
evaluate, points (the committed result store), run, report."""
