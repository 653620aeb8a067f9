"""retrolog.versions"""
