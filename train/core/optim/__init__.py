"""The optimizer and its learning rate, each a table of one entry per name: optimizers
(OPTIMIZERS: OPTIMIZER's builders, with what each holds and needs), adafactor (the kit's Adafactor
with a relative step, OPTIMIZER=adafactor_relative) and schedules (SCHEDULES: LR_SCHEDULE's
curves, and the Schedule the loop reads the lr from). config.py's choices are these tables' names.
Imports torch only inside the builders (config.py reads the tables) and train/core's other modules
never."""
