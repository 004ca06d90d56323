"""One step on this stage: what the worker remembers about each live sequence between plans
(`sequence_table.py`), a plan turned into the step's inputs (`step_inputs.py`, with the cascade
attention's shared-KV runs from `cascade_inputs.py`), the step's result on its way back to the
host (`step_results.py`), and the step thread that runs plans back to back (`step_thread.py`)
with what one plan's step does there (`stage_step.py`: inputs from the link, launch, outputs
handed on). `runner.py`, above this room, puts them together.
"""
