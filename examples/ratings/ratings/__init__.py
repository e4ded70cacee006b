"""A user's own project on the trainer: predict a user's star rating of an item.

Two inputs (user id, item id), a custom loss (Huber) and custom metrics (RMSE, MAE, the share of
predictions within half a star), plugged in through the trainer's contracts: a data factory
(ratings.data:load), a model factory (ratings.model:build) and a Task (ratings.task:RatingTask).
Nothing here imports the trainer's internals; see README.md beside this folder.
"""
