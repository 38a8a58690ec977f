"""The judges: what scores a turn from the state that followed it, and what writes its hint."""
