"""Calibration on data: what a compress-aware model learns from a few batches before (or instead
of) training. `input_moments.py` records each module's input moments and re-chooses the
input-weighted mse ranges (qcompress.calibrate_weight_ranges); `gptq.py` solves the weights of
`observer: gptq` groups; `blocks.py` runs a model's repeated blocks one at a time for that solve;
`learn_ranges.py` trains the learned ranges alone on a loss (qcompress.learn_ranges).

They sit above nn/ (they run compress-aware modules) and below rewrite / schedule; the tensor
math they call (observers, the GPTQ solver, static activation ranges) lives in quant/.
"""
