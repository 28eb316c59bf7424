"""Operating a node: recon, GPU slots, assets, job logs."""
