"""retrolog.query"""
