from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=50)


class Invoice(models.Model):
    order_id = models.IntegerField()  # no unique key: an order invoiced twice would show
