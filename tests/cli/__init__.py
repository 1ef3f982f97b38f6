"""Tests of the torchsurgery command (a package, so its test modules may share names with the root ones)."""
