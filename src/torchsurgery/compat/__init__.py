"""Drop-in modules with other projects' names and signatures, built on torchsurgery."""
