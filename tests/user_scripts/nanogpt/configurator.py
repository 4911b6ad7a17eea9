# Overrides the training script's globals: `python train.py --key=value ...` (a bare file name, a config file,
# is executed first). Run with exec() from the training script, so it sees and sets the script's globals.
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    if "=" not in arg:
        assert not arg.startswith("--")
        print(f"Overriding config with {arg}:")
        with open(arg) as f:
            exec(f.read())
    else:
        assert arg.startswith("--")
        key, val = arg.split("=", 1)
        key = key[2:]
        if key in globals():
            try:
                attempt = literal_eval(val)
            except (SyntaxError, ValueError):
                attempt = val
            assert type(attempt) == type(globals()[key]), f"type of {key} is {type(globals()[key])}"
            print(f"Overriding: {key} = {attempt}")
            globals()[key] = attempt
        else:
            raise ValueError(f"Unknown config key: {key}")
