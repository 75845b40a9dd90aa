"""Pure analysis: rule matching, detectors and correlation into incidents."""
