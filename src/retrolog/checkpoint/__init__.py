"""retrolog.checkpoint"""
