"""Calibration: text windows (dataset) -> activations (capture) -> running moments (statistics) ->
NBL weights and layer scores (solve) -> the calibration artifact (artifact); apply puts NBL into a
PyTorch model; calibrate is the `calibrate` command. Imports models, llamacpp and errors only."""
