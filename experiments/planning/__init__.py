"""The planning study (issue 56): Sudoku, Countdown, answer-only multiplication and path-star planning, AR vs MDLM
vs BD3LM vs SetDLM trained from scratch at equal parameters and training FLOPs, decoding policies chosen on dev,
difficulty curves on test, the order each method fills a Sudoku (``tools/reproduce.py --planning``): plan, data,
policies, evaluate, run, report."""
