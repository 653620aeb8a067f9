"""retrolog.runtime"""
