"""The bottom layer's process utilities: children that die with their parent, names in ps, systemd notify."""
