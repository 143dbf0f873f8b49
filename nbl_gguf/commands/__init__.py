"""The commands (`calibrate`, `convert`, `inspect`, `bench`, `eval`): the top floor over the pipeline
stages. Each module parses its flags (add_arguments; the shared ones in flags) and calls the stages
in order (run); no stage imports a command (tests/test_layout.py)."""
