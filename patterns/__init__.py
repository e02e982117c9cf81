"""Subgraph recognisers: shapes in the ATen graph that a region can compute better than op by op."""
