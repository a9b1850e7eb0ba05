"""Which prefix to verify: verification policies, the SPS cost profile, confidence calibration."""
