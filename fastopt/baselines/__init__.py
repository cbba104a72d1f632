"""Reference implementations that fastopt is compared against (each imports its framework lazily).

``fastopt.baselines.pyg_tgn.run_pyg_tgn`` trains PyTorch Geometric's TGN the way its users run it.
"""
