export PYTHONPATH=.
python benchmarks/decode_layers.py --contexts 32,33,64,65,170 --ways layers --replays 400 2>&1 | tail -7
python benchmarks/decode_layers.py --contexts 32,33 --ways layers --replays 400 2>&1 | tail -3
