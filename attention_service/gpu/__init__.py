"""What the attention service needs on a GPU that the CPU path does not: knowing, before a card is
bought or a model loaded, what its memory must hold (vram.py), and the pieces that make decode steps
cheap there. The CPU path keeps weights quantized in host memory and needs none of it."""
