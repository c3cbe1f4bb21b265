"""Deployment files: example adapters and the script that trains them."""
