"""Examples of serving models through the tokenspeed-kernel public APIs (not part of any wheel)."""
