"""The command line: `generate` (llama.cpp's flags, scripts/generate.py) and its interactive
`chat`."""
