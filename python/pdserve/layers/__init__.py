"""Model building blocks: linear/embedding/norm/rotary layers, attention backends, MoE."""
