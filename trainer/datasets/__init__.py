"""Built-in dataset factories, one family per module; registry.py names them. Importing this
package loads nothing heavy: sklearn, torchvision and PIL are imported by the factory that needs them."""
