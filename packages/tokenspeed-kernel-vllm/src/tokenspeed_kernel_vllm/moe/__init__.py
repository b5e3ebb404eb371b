"""MoE methods served by tokenspeed-kernel: unquantized experts and GPT-OSS MXFP4 experts."""
